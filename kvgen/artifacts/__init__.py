"""5. What ships: the registry manifest (format, reading, verification) and kernel wheels.

Nothing here knows how an artifact was made: the build writes this format, the runtime reads it.
"""
