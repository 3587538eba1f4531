"""Numbers beyond a double's range in JSON text, looked for in compiled code.

Contract: :func:`json_number_may_overflow` says whether a JSON text may hold a number
that a double cannot hold (an exponent of 100 or more, or 200 digits in a row, inside a
string too), as the regular expression ``[0-9.][eE]\\+?0*[1-9][0-9]{2}|[0-9]{200}``
finds one, in one pass in C. A text it answers False for holds no such number; one it
answers True for is left to a full parser to decide. This is the record codec's loop
(:mod:`kiproxy.protocol._codec`), offered here so that plugins, built-in ones included,
need only the plugin API, as :mod:`kiproxy.interceptors.sealing` offers its sealing
loops.
"""

from __future__ import annotations

from kiproxy.protocol._codec import json_number_may_overflow

__all__ = ["json_number_may_overflow"]
