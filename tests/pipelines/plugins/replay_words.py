"""Constants shared by the replay test plugins (imported as a sibling module)."""

BAD_PREFIX = b"bad"
LOWER_PREFIX = b"lower:"
