"""``closedloop ui``: a local web viewer over the run store.

Server-rendered pages (FastAPI + Jinja2 with autoescaping, a strict Content-Security-Policy and
one small script for live refresh): runs, the trace of a run, the token view of a turn,
evaluations (τ-bench, KernelBench, FactGuard, any other) and training curves. Every read is one
short transaction on the store's file (:mod:`closedloop.ui.queries`), so a process writing the
same store only ever waits for the few milliseconds a read holds the file.
"""
