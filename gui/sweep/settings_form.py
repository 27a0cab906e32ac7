"""The sweep's own settings on the Sweep tab, in two columns: the trial count, devices per trial,
objective, sampler, pruner, seed, trial timeout, name and sweeps folder; read as the settings a sweep
starts with, and filled from an opened sweep's spec."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from multilane.gui.sweep.process import sweep_cli_has
from PySide6.QtWidgets import QComboBox, QGridLayout, QLabel, QLineEdit, QSpinBox, QWidget


class SweepSettings(QWidget):
    """The fields of a sweep's settings (everything else comes from the Setup form)."""

    def __init__(self) -> None:
        super().__init__()
        self.trials = QSpinBox()
        self.trials.setRange(1, 100_000)
        self.trials.setValue(10)
        self.per_trial = QSpinBox()
        self.per_trial.setRange(1, 64)
        self.per_trial.setToolTip("Devices per trial: the chosen devices are split into slots of this many")
        self.objective = QLineEdit("val_loss:min")
        self.objective.setToolTip("A logged metric and its direction: val_loss:min, accuracy:max, loss:min")
        self.sampler = QComboBox()
        self.sampler.addItems(["tpe", "random", "grid"])
        self.pruner = QComboBox()
        self.pruner.addItems(["median", "halving", "none"])
        self.seed = QLineEdit()
        self.seed.setPlaceholderText("none")
        self.name = QLineEdit("sweep")
        self.folder = QLineEdit("sweeps")
        self.folder.setToolTip("Where sweep folders go: each holds study.journal and one run folder per trial")
        self.timeout = QSpinBox()
        self.timeout.setObjectName("sweep_trial_timeout")
        self.timeout.setRange(0, 7 * 24 * 3600)
        self.timeout.setSingleStep(60)
        self.timeout.setSuffix(" s")
        self.timeout.setSpecialValueText("none")
        if sweep_cli_has("--trial-timeout"):
            self.timeout.setToolTip(
                "A trial still running after this long is stopped and recorded failed (none: no limit)"
            )
        else:
            self.timeout.setEnabled(False)
            self.timeout.setToolTip("This multilane's sweep has no --trial-timeout yet")
        form = QGridLayout(self)  # two columns
        form.setContentsMargins(0, 0, 0, 0)
        fields = [("trials", self.trials), ("devices per trial", self.per_trial), ("objective", self.objective),
                  ("sampler", self.sampler), ("pruner", self.pruner), ("seed", self.seed),
                  ("trial timeout", self.timeout), ("name", self.name), ("sweeps folder", self.folder)]  # fmt: skip
        for i, (label, w) in enumerate(fields):
            form.addWidget(QLabel(label), i // 2, (i % 2) * 2)
            form.addWidget(w, i // 2, (i % 2) * 2 + 1)
        form.setColumnStretch(1, 1)
        form.setColumnStretch(3, 1)

    def values(self, devices: str, storage: str | None) -> dict[str, Any]:
        """The settings a sweep starts with, on ``devices`` (the Setup form's) with its study in ``storage``."""
        seed = self.seed.text().strip()
        return {
            "devices": devices,
            "trials": self.trials.value(),
            "per_trial": self.per_trial.value(),
            "objective": self.objective.text().strip() or "val_loss:min",
            "sampler": self.sampler.currentText(),
            "pruner": self.pruner.currentText(),
            "seed": int(seed) if seed.isdigit() else None,
            "name": self.name.text().strip() or "sweep",
            "storage": storage,
            "trial_timeout": self.timeout.value() or None if self.timeout.isEnabled() else None,
        }

    def show_spec(self, spec: Any, sweeps_folder: Path) -> None:
        """An opened sweep's own settings (a resume keeps them); ``sweeps_folder`` holds its folder."""
        self.trials.setValue(spec.trials)
        self.per_trial.setValue(spec.per_trial)
        self.objective.setText(f"{spec.objective}:{'max' if spec.direction == 'maximize' else 'min'}")
        self.sampler.setCurrentText(spec.sampler)
        self.pruner.setCurrentText(spec.pruner)
        self.seed.setText("" if spec.seed is None else str(spec.seed))
        self.name.setText(spec.name)
        self.timeout.setValue(int(getattr(spec, "trial_timeout", None) or 0))
        self.folder.setText(str(sweeps_folder))
