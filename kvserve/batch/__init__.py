"""The batch API (OpenAI's /v1/files and /v1/batches): files on disk with their records in the store,
batches validated whole at creation, and a runner that feeds their lines to the completion service at
batch priority, durably (each line's state in the store) and billed once (usage rows keyed by line)."""
