"""Seeing what the runtime did: hook-call tracing, the hang watchdog, comms accounting."""
