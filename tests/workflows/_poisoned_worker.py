"""worker.py's worker, poisoned once it is up: every chunk and every open fails, for no fault of theirs.

    python -m tests.workflows._poisoned_worker ADDRESS QUEUE STORE_URL KEYRING_FILE HOME

It runs `worker.serve` (what `python worker.py` runs once its embedded stack is up: both queues,
workflows and activities, the warm-up, the exit status), with stream activities that load and
warm tiny-mamba2 normally and then fail every attempt with the error a half-imported module
gave a real worker (`AttributeError: module 'sympy' has no attribute 'core'`). Its exit status
is the process's.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from mamba_stream.activities import StreamActivities, open_store
from mamba_stream.activities._registry import ModelRegistry
from mamba_stream.scan import Model
from mamba_stream.worker import WorkerConfig, load_keyring, serve

POISON = "module 'sympy' has no attribute 'core'"


class Poisoned(StreamActivities):
    poisoned = False

    def warm(self, model_ids: list[str] | None = None) -> dict[str, float]:
        took = super().warm(model_ids)
        self.poisoned = True  # from here on, as after an import that a cancellation broke
        return took

    def engine(self, model: Model):
        if self.poisoned:
            raise AttributeError(POISON)
        return super().engine(model)


def main() -> int:
    address, queue, store_url, keyring_file, home = sys.argv[1:6]
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = WorkerConfig(home=Path(home), address=address, task_queue=queue, store_url=store_url,
                       keyring=keyring_file, models="tiny-mamba2", backend="reference", metrics="off", sweep_s=0)
    acts = Poisoned(models=ModelRegistry.from_spec(cfg.models, backend=cfg.backend), store=open_store(cfg.store),
                    keyring=load_keyring(cfg))
    return serve(cfg, activities=acts)


if __name__ == "__main__":
    sys.exit(main())
