"""Starting multilane's own processes (sweep trials, ddp ranks) forked from a server that has imported
torch, instead of as fresh interpreters that each import it again."""

NODE_FILE_ENV = "MULTILANE_NODE_FILE"  # where a node's ranks tell their launcher the run folder
