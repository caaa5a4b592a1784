"""The path an object takes through atorch's files: the first call into each atorch function that
receives it as an argument (a loop over candidates calls the same functions again; a reader
follows them once), as the sequence of files those calls are in. A *stay* is a run of
calls in one file; a *return* is a stay in a file the object had already left. Many returns mean
the work on it goes back and forth between modules instead of from stage to stage."""

import sys
from pathlib import Path

ATORCH = str(Path(__file__).resolve().parents[2] / "atorch")


class ModelPath:
    def __init__(self, obj):
        self.obj = obj
        self.files: list[str] = []
        self._seen: set = set()

    def _profile(self, frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(ATORCH):
            return
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if code not in self._seen and any(frame.f_locals.get(name) is self.obj for name in names):
            self._seen.add(code)  # each function once: the path as a reader follows the code
            self.files.append(code.co_filename[len(ATORCH) + 1:])

    def __enter__(self):
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)

    def stays(self) -> list[str]:
        return [f for i, f in enumerate(self.files) if i == 0 or self.files[i - 1] != f]

    def returns(self) -> int:
        seen, count = set(), 0
        for stay in self.stays():
            count += stay in seen
            seen.add(stay)
        return count
