"""The shared language of gateway and workers: message Structs, block hashes, errors.

Only msgspec and the standard library may be imported here: both sides must agree bit for bit.
"""
