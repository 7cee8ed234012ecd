"""Rebuild `general_text.txt.xz` from the two Debian packages it is cut from (see README.md here).

    apt-get download dict-jargon=4.4.7-3.1 dict-devil=1.0-13.1
    python make_text.py dict-jargon_4.4.7-3.1_all.deb dict-devil_1.0-13.1_all.deb

Both packages hold a dictd database (`usr/share/dictd/*.dict.dz`, gzip-compatible dictzip). The text is taken
from the first entry to the last: the database headers, the Devil's Dictionary's title page and the character
index lines at the end are dropped, the Jargon File's indentation is removed, its paragraphs are joined onto one
line each, its `{cross reference}` braces removed, its ASCII-art lines (under half letters, digits and spaces)
dropped, and every third of its entries kept (in order, to keep the file small). Nothing is reworded. The output is written with `lzma` preset 9 | extreme (about 3.4:1).
"""

from __future__ import annotations

import gzip
import io
import lzma
import re
import subprocess
import sys
import tarfile
from pathlib import Path

JARGON_EVERY = 3


def dict_text(deb: str, name: str) -> str:
    """The decompressed `usr/share/dictd/{name}.dict.dz` of the Debian package `deb` (needs `dpkg-deb`)."""
    data = subprocess.run(["dpkg-deb", "--fsys-tarfile", deb], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = tar.extractfile(f"./usr/share/dictd/{name}.dict.dz")
        return gzip.decompress(member.read()).decode("utf-8")


def _prose(line: str) -> bool:
    s = line.strip()
    return bool(s) and sum(c.isalnum() or c.isspace() for c in s) >= 0.5 * len(s) + 1


def jargon(text: str) -> str:
    """The Jargon File's entries from "(TM)" on: headword line, then its paragraphs joined onto single lines."""
    text = text[text.index("\n(TM)\n") + 1 : text.rindex("\n !$&")]
    out, para = [], []
    for line in text.splitlines():
        if line.startswith("    ") and _prose(line):
            para.append(line.strip())
            continue
        if para:
            out.append(" ".join(para))
            para = []
        if line and not line.startswith(" ") and _prose(line):  # a headword
            out.append("")
            out.append(line.strip())
    if para:
        out.append(" ".join(para))
    entries = "\n".join(out).strip().split("\n\n")
    joined = "\n\n".join(entries[::JARGON_EVERY]) + "\n"
    joined = re.sub(r"\{\s*([^{}]*?)\s*\}", r"\1", joined)
    return re.sub(r"[ \t]+", " ", joined)


def devil(text: str) -> str:
    """The Devil's Dictionary from its preface to its last entry, as published (line breaks kept)."""
    start = text.index("                              PREFACE")
    end = text.rindex("\n abcdefghijklmnopqrstuvwxyz")
    return text[start:end].strip() + "\n"


def main(jargon_deb: str, devil_deb: str, out: str = "general_text.txt.xz") -> None:
    parts = [devil(dict_text(devil_deb, "devil")), jargon(dict_text(jargon_deb, "jargon"))]
    text = "\n\n".join(parts)
    Path(out).write_bytes(lzma.compress(text.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))
    print(f"{out}: {len(text)} characters, {Path(out).stat().st_size} bytes")


if __name__ == "__main__":
    main(*sys.argv[1:])
