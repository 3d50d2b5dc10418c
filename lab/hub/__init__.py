"""A local Hugging Face hub for the lab and the tests: what huggingface_hub 2.4's
snapshot_download and hf_hub_download call, served from a directory, answered as the real hub
answers (docs/field.md, "The Hugging Face hub"), with fault switches.

Repos live at repos_dir/<org>/<name>/ (lab.tinymodel writes them). Each has one revision,
`main`, whose commit sha is derived from the files' content; a sibling file
repos_dir/<org>/<name>.gated (one token a line) makes the repo gated. Two origins, as on the
real hub: the hub itself and a storage host at another address that holds the LFS files.

    GET  /api/models/{repo}[/revision/{rev}][?blobs=true]   sha and siblings
    GET  /api/models/{repo}/tree/{rev}[/{path}]?recursive=  entries, paginated by a Link header
    HEAD /{repo}/resolve/{rev}/{path}                       X-Repo-Commit, ETag, sizes
    GET  /{repo}/resolve/{rev}/{path}                       small files: the bytes (Range: 206)
                                                            LFS files: 302 to a signed storage
                                                            URL, X-Linked-Size, X-Linked-Etag
    GET  <storage>/lfs/{repo}/{sha256}?expires=&signature=  the LFS bytes (Range: 206); no token

Errors carry X-Error-Code and X-Error-Message: a gated repo is 401 GatedRepo without a token and
403 GatedRepo with one that is not on its list; a missing repo is 401 RepoNotFound anonymously
and 404 with a token; a missing revision or file is 404 RevisionNotFound or EntryNotFound; a
token not shaped like a Hugging Face token (`hf_...`) is 401 "Invalid credentials in
Authorization header" on every endpoint.

Lab control: GET/POST /_lab/faults (JSON: fail_next + status + retry_after, cut_next_file, slow,
reset) and GET/POST /_lab/stats (requests, bytes served, and per origin the Authorization
headers received as fingerprints; POST {"reset": true} zeroes them); HubControl calls them.

One module per job:
  index.py        the repos on disk: files, digests (cached), commit sha, gating; index_repo()
  server.py       HubServer: the two origins in threads of a process, signed storage URLs
  handler.py      a request: routing, the hub's answers, the storage host's, lab control
  errors.py       HubError, an error answer as the hub words it; the injected failures'
  faults.py       the fault switches (failures, cut files, slow bodies)
  request_log.py  the origins, the request log and its statistics
  control.py      HubControl: a hub in another process, driven over /_lab/
  __main__.py     `python -m lab.hub`: the hub as its own process (the lab's)
"""
