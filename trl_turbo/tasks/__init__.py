"""Verifiable toy tasks with shipped data and TRL-style reward functions (see :mod:`trl_turbo.tasks.arithmetic`), and
the real instruct model the examples train on them (:mod:`trl_turbo.tasks.smollm2`, fetched from the package index).

Design decision: each task lives in its own module and is imported explicitly, so ``import trl_turbo`` never pays
for ``datasets`` or reads task data.
"""
