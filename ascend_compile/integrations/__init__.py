"""Integrations with serving runtimes this project does not own, one module (or package: vllm/) each.

Every touch of a foreign runtime's internals lives in its module and is checked against the
versions it was written for.
"""
