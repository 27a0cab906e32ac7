"""Energy per log window and per epoch, where the GPUs report power (NVML's energy counter)."""

from __future__ import annotations

from typing import Any

from multilane.engine.telemetry.sampler import TelemetrySampler


class EnergyMeter:
    """Reads the sampler's running energy total (joules) and says what a window or an epoch used."""

    def __init__(self, sampler: TelemetrySampler | None) -> None:
        self.sampler = sampler
        self._at_log = self._at_epoch = 0.0

    def _total(self) -> float | None:
        return self.sampler.energy_j() if self.sampler is not None else None

    def at_log(self, samples: int) -> dict[str, Any]:
        """``energy_j`` (the run's total so far) and ``samples_per_j`` of the window just logged."""
        energy = self._total()
        if energy is None:
            return {}
        out: dict[str, Any] = {"energy_j": energy}
        used = energy - self._at_log
        if used > 0:
            out["samples_per_j"] = samples / used  # = samples per second per watt
        self._at_log = energy
        return out

    def at_epoch(self, samples: int) -> dict[str, Any]:
        """``energy_j`` the epochs just ended took, and their ``samples_per_j``."""
        energy = self._total()
        if energy is None:
            return {}
        used = energy - self._at_epoch
        out: dict[str, Any] = {"energy_j": used}
        if used > 0:
            out["samples_per_j"] = samples / used
        self._at_epoch = energy
        return out
