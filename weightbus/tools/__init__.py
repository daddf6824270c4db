"""The command-line tools: ``weightbus`` (cli), its demo and its benchmark."""
