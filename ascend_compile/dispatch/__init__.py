"""Calling a compiled step's graph without dynamo's frame hook and guards (`dispatch="direct"`).

Through dynamo, every call evaluates guards over every parameter, buffer and input and fetches
each lifted parameter again before the graph runs: several hundred microseconds on a 64-layer model,
several times what the runner itself costs. After one call through dynamo, a direct call gathers
the graph's arguments with one generated function (parameters and buffers gathered once), runs
cheap checks standing in for dynamo's guards, and calls the graph; whatever a check catches sends
that call through dynamo again. `checks.py` lists the checks; what they do not catch is written
beside the option (README, "Calling the graph directly").

- `graph_inputs.py`: what dynamo passes the graph and where it finds it, kept at compile time;
- `dynamo_code.py`: dynamo's code for the frame, read for anything a direct call would skip;
- `frame.py`: the traced function and how a call's arguments become its locals;
- `epoch.py`: a count of assignments into any module's parameters, buffers and submodules;
- `checks.py`, `route.py`: one layout's checks and gathering, generated once;
- `dispatcher.py`: the routes of a compiled step.
"""
from .dispatcher import DirectDispatcher

__all__ = ["DirectDispatcher"]
