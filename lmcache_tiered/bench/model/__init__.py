"""The measurement model (``lmcache-tiered bench``): a workload replayed
through the real LMCache engine and the real tiers, with the GPU and the
drives modelled at production rates, against vLLM alone and LMCache's own
disk backend."""
