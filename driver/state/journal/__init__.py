"""The prepare journal: checkpoint, log, entries and records; the node lock; the boot id."""
