"""The runs table (``runs_table.py``), its rows read from the runs folder (``runs_index.py``), its "Send to
MLflow…" (``mlflow_send.py``), and the cell that sorts by value, which the sweep's trials table uses too
(``cells.py``). The window shows the table; nothing here imports the window."""
