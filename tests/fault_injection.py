"""Runs ``python -m train`` with one fault injected (used by tests/test_faults.py).

    python tests/fault_injection.py FAULT STEP -- CONFIG [key=value ...]

FAULT is one of:
  kill-in-step        SIGKILL right after dispatching the step that makes STEP,
                      while it computes
  kill-in-checkpoint  SIGKILL after the checkpoint of STEP is written but before
                      orbax commits it (renames it into place)
  file-size-limit     once the checkpoint of STEP is on disk, limit the size of
                      any file this process writes to 16 KiB (RLIMIT_FSIZE), so
                      the next checkpoint write fails as on a full disk
  read-only           once the checkpoint of STEP is on disk, remount the
                      checkpoint directory read-only (it must be the mount point
                      of a tmpfs this process may remount)
"""

import os
import resource
import signal
import sys


def _kill():
    os.kill(os.getpid(), signal.SIGKILL)


def _after_saving(checkpointer_class, step: int, fault) -> None:
    """Makes ``fault(checkpointer)`` happen once the checkpoint of ``step`` is on disk."""
    save = checkpointer_class.save

    def save_then_fault(self, state, meta):
        out = save(self, state, meta)
        if out == step:
            self.wait()
            fault(self)
        return out

    checkpointer_class.save = save_then_fault


def main() -> int:
    fault, step, sep, *args = sys.argv[1:]
    step = int(step)
    assert sep == "--", __doc__
    import train.experiment.loop
    from train.training import checkpoint

    if fault == "kill-in-step":
        make = train.experiment.loop.make_train_step

        def make_killing(**kwargs):
            step_fn = make(**kwargs)

            def killing(state, batch):
                target = int(state.step) + 1
                out = step_fn(state, batch)
                if target == step:
                    _kill()
                return out

            return killing

        train.experiment.loop.make_train_step = make_killing
    elif fault == "kill-in-checkpoint":
        from orbax.checkpoint._src.path import atomicity

        finalize = atomicity.AtomicRenameTemporaryPath.finalize

        async def killing_finalize(self, *a, **k):  # the rename of the step directory into place
            if os.path.basename(os.fspath(self._final_path)) == str(step):
                _kill()
            return await finalize(self, *a, **k)

        atomicity.AtomicRenameTemporaryPath.finalize = killing_finalize
    elif fault == "file-size-limit":
        def limit_file_size(_):
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes fail with EFBIG instead of killing us
            resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

        _after_saving(checkpoint.Checkpointer, step, limit_file_size)
    elif fault == "read-only":
        import subprocess

        def lose_write_access(checkpointer):
            subprocess.run(["mount", "-o", "remount,ro", checkpointer.directory], check=True)

        _after_saving(checkpoint.Checkpointer, step, lose_write_access)
    else:
        raise SystemExit(f"unknown fault {fault!r}\n{__doc__}")
    from train.cli import main as cli

    return cli(args)


if __name__ == "__main__":
    sys.exit(main())
