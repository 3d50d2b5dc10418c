"""Writes sparkdeploy/steps/quality/english_words.txt.gz, the typo-rate eval's word list, from
Debian's SCOWL lists (docs/quality.md#the-word-list):

    apt-get install wamerican wbritish
    .venv/bin/python scripts/make_word_list.py

Lowercase words only (a capitalized word is a name, which the eval skips) and no possessives
(the eval takes the 's off), one a line, sorted; gzip's mtime is 0 so the same lists give the
same bytes.
"""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

SOURCES = (Path("/usr/share/dict/american-english"), Path("/usr/share/dict/british-english"))
TARGET = Path(__file__).resolve().parents[1] / "sparkdeploy/steps/quality/english_words.txt.gz"


def main() -> int:
    missing = [str(source) for source in SOURCES if not source.is_file()]
    if missing:
        print(f"missing {', '.join(missing)}: apt-get install wamerican wbritish", file=sys.stderr)
        return 1
    words = {
        word
        for source in SOURCES
        for word in source.read_text(encoding="utf-8").split()
        if word.islower() and not word.endswith("'s")
    }
    text = "".join(f"{word}\n" for word in sorted(words)).encode()
    TARGET.write_bytes(gzip.compress(text, compresslevel=9, mtime=0))
    print(f"{TARGET}: {len(words)} words, {TARGET.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
