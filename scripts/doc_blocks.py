"""Generated blocks in the docs, shared by scripts/serve_tables.py and scripts/doc_tables.py: a
block sits between `<!-- TAG: NAME -->` and `<!-- /TAG -->` in a doc, and is rewritten from
committed JSON by the renderer registered under NAME; nothing outside the markers is touched.

`refresh` rewrites (or, with `check`, only compares) every block of the given docs, and refuses
JSON that holds a machine's path or name (`leaks`); `strip_paths` is what writers of that JSON
run over a report before they commit it.
"""

from __future__ import annotations

import re
import socket
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

Renderer = Callable[[dict[str, Any]], list[str]]

PATH_KEYS = ("work", "log", "log_path", "log_dir")
"""Keys whose values are a run's own directories: dropped whole."""
HOST_KEYS = ("hostname", "nodename")
"""Keys whose values name the machine: dropped whole (and `host` when it holds a name, not figures)."""
ABSOLUTE = re.compile(r"(?<![\w.])/(?:[\w.+-]+/)+([\w.+-]+)")
CONTENT_PATH = re.compile(r"/(?:dev|proc|sys)/|/etc/passwd\b")
"""Absolute paths that are what a figure is about, not where it ran: the shm directory, /proc,
and the files an attack names (the forged-peer test's `/etc/passwd`)."""
IPV4 = re.compile(r"(?<![\w.])(\d{1,3})\.\d{1,3}\.\d{1,3}\.\d{1,3}(?![\w.])")


def block_pattern(tag: str) -> re.Pattern[str]:
    t = re.escape(tag)
    return re.compile(rf"(<!-- {t}: (?P<name>[a-z0-9_]+) -->\n)(?P<body>.*?)(<!-- /{t} -->)", re.S)


def _machine_path(m: re.Match) -> bool:
    return not CONTENT_PATH.match(m.group(0))


def strip_paths(data: Any) -> Any:
    """The report without machine paths or names: no work and log directories, no host name, and
    an absolute path inside any other text (a model directory, a traceback's file) cut to its last
    part (paths under /dev, /proc and /sys, and /etc/passwd, are kept: they are what a figure is about)."""
    if isinstance(data, dict):
        return {k: strip_paths(v) for k, v in data.items()
                if k not in PATH_KEYS and k not in HOST_KEYS and not (k == "host" and isinstance(v, str))}
    if isinstance(data, list):
        return [strip_paths(v) for v in data]
    if isinstance(data, str):
        return ABSOLUTE.sub(lambda m: m.group(1) if _machine_path(m) else m.group(0), data)
    return data


def leaks(data: Any, hostname: str | None = None) -> list[str]:
    """Where `data` holds a machine path (absolute, outside /dev, /proc, /sys and /etc/passwd), a
    run's directory, a host name (a `hostname`/`nodename` key, a `host` key holding text, or
    `hostname`, default this machine's, as a word) or an IPv4 address other than loopback's."""
    hostname = socket.gethostname() if hostname is None else hostname
    word = re.compile(rf"(?<![\w.-]){re.escape(hostname)}(?![\w-])") if hostname else None
    found = []

    def text(where: str, s: str) -> None:
        for m in ABSOLUTE.finditer(s):
            if _machine_path(m):
                found.append(f"{where}: path {m.group(0)!r}")
        for m in IPV4.finditer(s):
            if m.group(1) not in ("127", "0"):
                found.append(f"{where}: address {m.group(0)!r}")
        if word and word.search(s):
            found.append(f"{where}: host name {hostname!r}")

    def visit(x: Any, where: str) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                path = f"{where}.{k}" if where else str(k)
                if k in PATH_KEYS or k in HOST_KEYS or (k == "host" and isinstance(v, str)):
                    found.append(f"{path}: key {k!r}")
                text(f"{path} (key)", str(k))
                visit(v, path)
        elif isinstance(x, list):
            for i, v in enumerate(x):
                visit(v, f"{where}[{i}]")
        elif isinstance(x, str):
            text(where, x)

    visit(data, "")
    return found


GENERATED_TAGS = ("figures", "serve-check")
"""The tags of generated blocks (scripts/doc_tables.py's and scripts/serve_tables.py's)."""
_DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+(?![\w.])")
"""A decimal number (not a version such as 0.3.13, nor an address)."""
_MEASURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:ms|µs|us|ns|s|min|GB/s|GiB/s|MB/s|MiB/s|Gbit/s|Gb/s|x|×|%)"
                      r"(?![\w/])")
"""A number with a unit of time, rate, ratio or share: what a measurement reads."""


def tables_outside_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """Each markdown table of `text` that is neither in a generated block nor in a code fence:
    (its first line's number, its header row, its body rows)."""
    tables: list[tuple[int, str, list[str]]] = []
    block = fence = False
    current: list[str] = []
    start = 0
    for i, line in enumerate([*text.splitlines(), ""], 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = not fence
        opened = re.match(r"<!-- ([a-z-]+): [a-z0-9_]+ -->$", stripped)
        if opened and opened.group(1) in GENERATED_TAGS:
            block = True
        elif re.match(r"<!-- /([a-z-]+) -->$", stripped):
            block = False
        if stripped.startswith("|") and not fence and not block:
            start = start or i
            current.append(stripped)
            continue
        if current:
            tables.append((start, current[0], current[2:]))
        current, start = [], 0
    return tables


def holds_figures(rows: list[str]) -> bool:
    """Whether table rows read as measured figures: several decimal numbers, or numbers in units of
    time, rate, ratio or share."""
    body = "\n".join(rows)
    return len(_DECIMAL.findall(body)) >= 3 or len(_MEASURE.findall(body)) >= 2


def render(text: str, pattern: re.Pattern[str], renderers: Mapping[str, Renderer], data: dict[str, Any]) -> str:
    """`text` with every block of `pattern` rewritten by its renderer from `data`."""
    def block(m: re.Match) -> str:
        name = m.group("name")
        if name not in renderers:
            raise SystemExit(f"error: unknown generated block {name!r} (known: {', '.join(renderers)})")
        return m.group(1) + "\n".join(renderers[name](data)) + "\n" + m.group(4)
    return pattern.sub(block, text)


def refresh(docs: tuple[Path, ...], pattern: re.Pattern[str], renderers: Mapping[str, Renderer],
            data: dict[str, Any], sources: Mapping[str, Any], check: bool, script: str) -> int:
    """Rewrite every block of `docs` from `data` (with `check`, write nothing and exit 1 naming the
    docs whose blocks differ); either way exit 1, writing nothing, when a JSON of `sources` (name:
    its content) holds a machine path or name."""
    bad = [f"{name}: {x}" for name, content in sources.items() for x in leaks(content)]
    if bad:
        print("machine paths or names in the committed JSON (run its writer again, or strip_paths over it):\n  "
              + "\n  ".join(bad), file=sys.stderr)
        return 1
    stale = []
    for doc in docs:
        old = doc.read_text()
        new = render(old, pattern, renderers, data)
        if new != old:
            stale.append(doc.name)
            if not check:
                doc.write_text(new)
    if check and stale:
        print(f"stale generated blocks in {', '.join(stale)}: run python {script}", file=sys.stderr)
        return 1
    return 0
