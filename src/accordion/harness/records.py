"""What a run leaves behind: its result (:class:`RunResult`), rank 0's per-epoch logs
(JSON lines, CSV, TensorBoard when installed) and the progress bar."""

from __future__ import annotations

import csv
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import TrainConfig

#: The scalars of every epoch record, as the CSV and TensorBoard write them.
_SCALARS = ("epoch", "train_loss", "test_metric", "floats", "bytes", "train_time_s", "lr")
#: The scalars only a sequence task's (``charlm``'s) records hold.
_SEQUENCE_SCALARS = ("val_loss", "perplexity")


@dataclass
class RunResult:
    """What one run produced: per-epoch records and the detector's checks."""

    strategy: str
    seed: int
    epochs: list[dict[str, Any]] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    mild: Any = None
    aggressive: Any = None
    batch_checks: list[dict[str, Any]] = field(default_factory=list)
    #: The cost model's report (``AccordionState.calibrate``) for ``:auto`` strategies.
    calibration: dict[str, Any] | None = None
    #: A DiLoCo run's rounds, warm-up steps and warm-up norm test (``None`` otherwise).
    diloco: dict[str, Any] | None = None
    #: A ``momentum=`` run's freeze step, steps and clipped steps (``None`` otherwise).
    momentum: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (the ``runs`` entries of ``results.json``)."""
        return dataclasses.asdict(self)


class Logger:
    """Rank 0's per-epoch logs: JSON lines, CSV, and TensorBoard when installed.

    With ``out`` None (every other rank) it only keeps the records."""

    def __init__(self, out: str | None, config: TrainConfig):
        self.dir = Path(out) if out else None
        self.writer = None
        self.rows: list[dict[str, Any]] = []
        if self.dir is None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        self.jsonl = (self.dir / "metrics.jsonl").open("w")
        try:  # imported here: TensorBoard is optional, and slow to import
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dir / "tensorboard"))
        except Exception:  # noqa: BLE001 - TensorBoard is optional
            self.writer = None

    def log(self, record: dict[str, Any]) -> None:
        """Keep one epoch's record and append it to the logs."""
        self.rows.append(record)
        if self.dir is None:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for key in (*_SCALARS[1:], *_SEQUENCE_SCALARS):
                if key in record:  # a sequence task's val_loss and perplexity too
                    self.writer.add_scalar(key, record[key], record["epoch"])

    def close(self, checks: list[dict[str, Any]], calibration: dict[str, Any] | None) -> None:
        """Write the CSV of every epoch, the detector's checks and the calibration."""
        if self.dir is None:
            return
        if calibration is not None:
            (self.dir / "calibration.json").write_text(json.dumps(calibration, indent=1) + "\n")
        self.jsonl.close()
        if self.writer is not None:
            self.writer.close()
        layers = sorted({k for row in self.rows for k in row["levels"]})
        scalars = list(_SCALARS) + [  # with a sequence task's val_loss and perplexity
            key for key in _SEQUENCE_SCALARS if self.rows and all(key in r for r in self.rows)
        ]
        with (self.dir / "metrics.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(scalars + [f"level:{name}" for name in layers])
            for row in self.rows:
                writer.writerow([row[k] for k in scalars] + [row["levels"].get(n) for n in layers])
        (self.dir / "checks.json").write_text(json.dumps(checks, indent=1) + "\n")


def progress_bar(config: TrainConfig):
    """A tqdm bar over the run's epochs, or ``None`` (``progress`` off, or no tqdm)."""
    if not config.progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional, and so imported only here
        return None
    return tqdm(total=config.epochs, desc=config.strategy, unit="epoch", dynamic_ncols=True)
