"""The asyncio facade every gateway uses, one per API process: TTSService and its wiring (ARCHITECTURE §2)."""
