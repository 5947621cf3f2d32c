"""Offline calibration text of three task types, like TANGRAM's Summary / Code / Retrieve (section 3.2).

Everything comes from the running Python installation or a seeded generator, so calibration
needs no download: "summary" is prose from the standard library's docstrings, "code" is
standard-library source with a question about a function in it, and "retrieval" is a synthetic
key-value list with a needle question. A task yields paragraphs until the caller has enough
tokens, then asks a question about the paragraphs that made it into the context.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
import string
from abc import ABC, abstractmethod
from collections.abc import Iterator
from functools import cache

CORPUS_NAME = "stdlib-v1"

# Pure-Python standard-library modules with substantial docstrings and source (Python >= 3.10).
STDLIB_MODULES = (
    "argparse ast asyncio.base_events calendar cmd collections concurrent.futures.process "
    "configparser contextlib copy csv dataclasses datetime decimal difflib dis email.message "
    "enum filecmp fileinput fnmatch fractions ftplib functools getopt gettext glob graphlib gzip "
    "heapq hmac html.parser http.client http.server imaplib inspect ipaddress json.decoder "
    "logging mailbox mimetypes numbers optparse pathlib pickle pkgutil platform poplib pprint "
    "queue random shlex shutil smtplib socket socketserver statistics string subprocess tarfile "
    "tempfile textwrap threading timeit tokenize trace traceback typing unittest.case "
    "urllib.parse urllib.request uuid warnings wave weakref zipfile"
).split()


class Task(ABC):
    """One task type: an endless paragraph stream and a question about what was kept."""

    name: str

    @abstractmethod
    def paragraphs(self, rng: random.Random) -> Iterator[str]:
        """Paragraphs of one context, forever (the caller stops at its token budget)."""

    @abstractmethod
    def question(self, rng: random.Random, paragraphs: list[str]) -> str:
        """A question answerable from ``paragraphs`` (the ones that fit in the context)."""


class SummaryTask(Task):
    """Documentation prose of random standard-library modules; asks for a summary."""

    name = "summary"

    def paragraphs(self, rng: random.Random) -> Iterator[str]:
        while True:
            module = rng.choice(STDLIB_MODULES)
            yield from _module_docs(module)

    def question(self, rng: random.Random, paragraphs: list[str]) -> str:
        style = rng.choice(["in three sentences", "as a bulleted list", "for a beginner"])
        return f"Summarize the documentation above {style}."


class CodeTask(Task):
    """Standard-library source from a top-level definition on; asks about one function in it."""

    name = "code"

    def paragraphs(self, rng: random.Random) -> Iterator[str]:
        while True:
            blocks = _source_blocks(rng.choice(STDLIB_MODULES))
            start = rng.randrange(len(blocks))
            yield from blocks[start:]

    def question(self, rng: random.Random, paragraphs: list[str]) -> str:
        names = sorted({m for p in paragraphs for m in _DEF.findall(p)})
        if not names:
            return "What does the code above do?"
        name = rng.choice(names)
        return f"In the code above, what does `{name}` do, and what does it return?"


class RetrievalTask(Task):
    """A synthetic registry of keys and values; asks for the value of one key (the needle)."""

    name = "retrieval"

    def paragraphs(self, rng: random.Random) -> Iterator[str]:
        while True:
            lines = [f"{_token(rng, 8)}: {_token(rng, 12)}" for _ in range(8)]
            yield "\n".join(lines)

    def question(self, rng: random.Random, paragraphs: list[str]) -> str:
        pairs = [line.split(": ") for p in paragraphs for line in p.splitlines()]
        key = rng.choice(pairs)[0] if pairs else "unknown"
        return f"In the registry above, what is the value for the key {key}? Answer with it only."


TASKS: tuple[Task, ...] = (SummaryTask(), CodeTask(), RetrievalTask())
TASK_NAMES = tuple(t.name for t in TASKS)

_DEF = re.compile(r"^\s*def (\w+)\(", re.MULTILINE)
_TOP_LEVEL = re.compile(r"^(?:def |class |async def |@)", re.MULTILINE)


def _token(rng: random.Random, length: int) -> str:
    return "".join(rng.choices(string.ascii_lowercase + string.digits, k=length))


@cache
def _module_docs(name: str) -> tuple[str, ...]:
    """The module docstring, then each public class and function docstring, as paragraphs."""
    module = importlib.import_module(name)
    docs = [f"Module {name}.\n\n{inspect.getdoc(module) or ''}".strip()]
    for attr, obj in sorted(vars(module).items()):
        if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and inspect.getdoc(obj):
            docs.append(f"{name}.{attr}: {inspect.getdoc(obj)}")
    return tuple(docs)


@cache
def _source_blocks(name: str) -> tuple[str, ...]:
    """The module's source split before every top-level definition (at least one block)."""
    source = inspect.getsource(importlib.import_module(name))
    cuts = [0] + [m.start() for m in _TOP_LEVEL.finditer(source)] + [len(source)]
    blocks = [source[a:b] for a, b in zip(cuts, cuts[1:], strict=False) if source[a:b].strip()]
    return tuple(blocks) or (source,)
