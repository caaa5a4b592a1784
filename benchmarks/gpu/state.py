"""The run's bookkeeping: one JSON file that records each unit as it starts and ends.

A unit is ``pending`` until it starts, ``running`` while it runs, then ``done``, ``skipped`` (it
cannot run here, and says why) or ``failed`` (an error or its own time limit). A unit stopped
by the invocation's budget goes back to ``pending``; one found ``running`` when a run starts was
cut by a killed command or a lost machine, and runs again. Every change is written at once
(atomically), so the file is right whenever the process dies.
"""

import json
import os
import time
from pathlib import Path

FINISHED = ("done", "skipped", "failed")


class State:
    def __init__(self, path: Path, data: dict):
        self.path = Path(path)
        self.data = data

    @classmethod
    def open(cls, path: Path, config: dict, fresh: bool = False) -> tuple["State", str]:
        """The state at ``path``, or a new one for ``config``; and a line that says which. A state
        taken with another config (another size, dry or not) is started again."""
        path = Path(path)
        if path.is_file() and not fresh:
            try:
                data = json.loads(path.read_text())
            except ValueError:
                data = None
            if data and data.get("config") == config:
                cut = [key for key, unit in data["units"].items() if unit["status"] == "running"]
                for key in cut:
                    data["units"][key]["status"] = "pending"
                    data["units"][key]["note"] = "cut in an earlier run (the command was stopped): run again"
                state = cls(path, data)
                state.save()
                done = sum(unit["status"] in FINISHED for unit in data["units"].values())
                return state, (f"resuming {path} (started {data['started']}): {done} units finished"
                               + (f", {len(cut)} cut and run again" if cut else ""))
            why = "another configuration" if data else "it does not read"
            reason = f"starting again ({path} was taken with {why})"
        else:
            reason = "starting again (--fresh)" if path.is_file() else f"new run in {path.parent}"
        state = cls(path, {"config": config, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                           "date": time.strftime("%Y-%m-%d", time.gmtime()), "units": {}})
        state.save()
        return state, reason

    def unit(self, key: str) -> dict:
        return self.data["units"].setdefault(key, {"status": "pending", "attempts": 0})

    def mark(self, key: str, status: str, **fields) -> None:
        unit = self.unit(key)
        unit.update(status=status, **fields)
        if status == "running":
            unit["attempts"] += 1
            unit["began"] = time.time()
        elif "began" in unit:
            unit["seconds"] = round(time.time() - unit.pop("began"), 1)
        self.save()

    def result(self, key: str) -> dict | None:
        unit = self.data["units"].get(key)
        return unit.get("result") if unit and unit["status"] == "done" else None

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(self.data, indent=2) + "\n")
        os.replace(partial, self.path)
