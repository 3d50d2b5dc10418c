"""What the tests and bench/ share, imported from the checkout like the rest of the lab.

One module per job:
  engine_chat.py      one user message to a deployment's chat API (the demo asks it too)
  hfcache_layout.py   a lab.tinymodel repo put into an HF cache as the prefetch leaves the NAS
  local_node.py       this machine as a node (LocalNode), or a node answering from a script
  page_cache.py       how much of a file the page cache holds, and dropping it
  standin_process.py  one engine stand-in as a local process serving a tiny model
  waiting.py          waiting for something to happen: a process to start, a line to appear
"""
