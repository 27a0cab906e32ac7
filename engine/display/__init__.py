"""What the CLI and the window both show of a run: outside text made safe for a terminal
(``terminal_text.py``), the devices' line (``device_line.py``), the live progress display, its summary
and the data-wait note (``progress.py``). The CLI, the ranks and the window import these; nothing here
imports them."""
