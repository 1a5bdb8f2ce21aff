"""Flatfare's benchmarks: what the platform costs against LiteLLM's proxy and vLLM direct.

``python -m bench overhead|engine|gpu|profile``; each writes a Markdown
and a CSV table with the machine, versions and settings, and PNG plots, to ``bench/results/``.
"""
