"""The build side: plan → trace → check → compile → bundle.

Nothing under neffkit.runtime imports this package."""
