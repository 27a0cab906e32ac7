"""Exporting a run's plots from the window: the dialog that asks where and how, and the job that writes them in a process of its own."""
