"""`python worker.py`: a mamba-stream worker from this checkout; with no configuration, the whole
embedded stack. The same as `python -m mamba_stream.worker` and the installed `mamba-stream-worker`;
its settings are documented in `mamba_stream/worker.py`."""

from mamba_stream.worker import main

if __name__ == "__main__":
    main()
