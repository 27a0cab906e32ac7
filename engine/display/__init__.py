"""What the CLI and the window both show of a run: text from outside made safe for a terminal (``terminal_text.py``)."""
