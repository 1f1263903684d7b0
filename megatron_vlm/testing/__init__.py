"""Offline builders of tiny artefacts (tokenizer, processor) for tests and the demo job.

Nothing here downloads anything: every file is produced by code, deterministically.
"""
