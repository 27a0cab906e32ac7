"""Multilane's desktop app (PySide6 + pyqtgraph): one client of ``multilane.engine``."""
