"""OpenAI's Files and Batch APIs (``pagoda serve --file-storage-path DIR``) and the offline
``pagoda run-batch``: files.py keeps the files, service.py runs the batches, lines.py reads and
runs their lines, routes.py serves them. This module holds only the defaults (the command
line reads them without importing the server)."""

# OpenAI's limits of a batch's input file.
DEFAULT_FILE_MAX_BYTES = 200 << 20
DEFAULT_BATCH_MAX_LINES = 50_000
# A batch's lines running at once, behind live traffic.
DEFAULT_BATCH_MAX_CONCURRENCY = 8
