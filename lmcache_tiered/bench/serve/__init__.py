"""The real-server benchmark (``lmcache-tiered serve-bench``): vLLM's
OpenAI server and ``lmcache server`` timed over HTTP on a trace, with the
measurement model's prediction of the same run."""
