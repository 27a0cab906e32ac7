"""`python kill_at.py PHASE SWEEP_ARGS...`: the real `multilane sweep`, SIGKILLed by itself at one phase
of its work, for the crash tests (test_sweep_kill_phases.py). The kill is real (signal 9, no clean-up);
only *when* it lands is chosen, by wrapping the product function the phase is in:

- ``asking``: the trial is asked (RUNNING in the journal), its worker's identity not yet written;
- ``sampling``: identity written, the first of two parameters suggested, the second not;
- ``sampled``: every parameter suggested, no run folder or trial process yet;
- ``trial-start``: the trial's process started, its pid not yet recorded in the study;
- ``storage``: trial 0's end being written to the journal: half of the record written (a torn record,
  as a kill between the write(2)s of a record larger than one write leaves it).
"""

import os
import signal
import sys

from multilane.engine.cli import main
from multilane.engine.sweep import runner, study


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(phase: str) -> None:
    if phase == "asking":
        study.worker_identity = lambda *a: die()
    elif phase == "sampling":
        from multilane.engine.sweep.space import ParamSpec

        suggest, seen = ParamSpec.suggest, []

        def once_then_die(self, trial):
            if seen:
                die()
            seen.append(self.key)
            return suggest(self, trial)

        ParamSpec.suggest = once_then_die
    elif phase == "sampled":
        runner.SweepRunner._begin = lambda *a: die()
    elif phase == "trial-start":
        runner.SweepRunner._run = lambda *a: die()
    elif phase == "storage":
        from optuna.storages.journal import JournalFileBackend
        from optuna.storages.journal._storage import JournalOperation

        append = JournalFileBackend.append_logs

        def torn(self, logs):
            if any(log.get("op_code") == JournalOperation.SET_TRIAL_STATE_VALUES and log.get("values") for log in logs):
                data = ("\n".join(__import__("json").dumps(log, separators=(",", ":")) for log in logs) + "\n").encode()
                with open(self._file_path, "ab") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                die()
            return append(self, logs)

        JournalFileBackend.append_logs = torn
    else:
        raise SystemExit(f"kill_at.py: unknown phase {phase!r}")


if __name__ == "__main__":
    arm(sys.argv[1])
    sys.exit(main(["sweep", *sys.argv[2:]]))
