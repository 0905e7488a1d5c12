"""End-to-end tests with a real vLLM (see conftest.py)."""
