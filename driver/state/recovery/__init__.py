"""Start-up recovery: the CDI root from the journal, MIG adoption, journal quarantine."""
