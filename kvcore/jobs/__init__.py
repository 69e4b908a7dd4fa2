"""Jobs: what a command runs, from options to a result (no printing; the CLI renders).

- `generate`: one prompt or several (`run_generate`), the options every run shape shares
  (`GenerateJob`, `BatchOptions`), its checks and its cache files;
- `batch`: several prompts through the continuous-batching engine (`run_batch`);
- `speculative`: draft-and-verify runs (`run_speculative`);
- `resume`: continuing from a cache file (`start_from_cache`, `open_for_model`, saving after a run).
"""
