"""What a request is: its types, errors, text hygiene, incremental text and validation (ARCHITECTURE §2)."""
