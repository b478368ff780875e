#!/usr/bin/env python3
"""Builds the SQLite full-text index searx's offline `sqlite` engine searches in the web tests.

Usage: build-index.py DOCS_DIR OUT.sqlite

Every *.html file under DOCS_DIR becomes one row of the FTS5 table `pages(path, title, body)`:
its path relative to DOCS_DIR, its <title>, and its visible text (scripts and styles left out).
The tests' searx settings turn a row into a result whose URL points at the local HTTP server
that serves DOCS_DIR, so every search result can be extracted.
"""
import html.parser
import os
import sqlite3
import sys


class Text(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.title, self.parts, self._skip, self._in_title = [], [], 0, False

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self._skip += 1
        elif tag == "title":
            self._in_title = True

    def handle_endtag(self, tag):
        if tag in ("script", "style") and self._skip:
            self._skip -= 1
        elif tag == "title":
            self._in_title = False

    def handle_data(self, data):
        if self._in_title:
            self.title.append(data)
        elif not self._skip:
            self.parts.append(data)


def main(docs, out):
    tmp = out + ".tmp"
    if os.path.exists(tmp):
        os.remove(tmp)
    db = sqlite3.connect(tmp)
    db.execute("CREATE VIRTUAL TABLE pages USING fts5(path UNINDEXED, title, body)")
    count = 0
    for root, _, files in os.walk(docs):
        for name in sorted(files):
            if not name.endswith(".html"):
                continue
            path = os.path.join(root, name)
            parser = Text()
            with open(path, encoding="utf-8", errors="replace") as page:
                parser.feed(page.read())
            title = " ".join("".join(parser.title).split())
            body = " ".join(" ".join(parser.parts).split())
            db.execute(
                "INSERT INTO pages VALUES (?, ?, ?)",
                (os.path.relpath(path, docs), title, body),
            )
            count += 1
    db.commit()
    db.close()
    if count == 0:
        sys.exit(f"build-index.py: no .html files under {docs}")
    os.replace(tmp, out)
    print(f"indexed {count} pages of {docs} into {out}", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
