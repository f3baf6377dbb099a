"""Execution: one case on one implementation. The adapter interface, the built-in adapters (lce
among them), `execute` (the one path a case takes on a rank), and the `Runner` that sends a case to
this process or to a pool's TP group and assembles what the ranks gave."""
