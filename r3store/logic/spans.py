"""Where stored bytes lie: the value types of the vocabulary's `r3store.spans`, under
the path callers outside the package import them by."""

from r3store.spans import COLUMNS as COLUMNS
from r3store.spans import PREFIX_SPAN_NAMES as PREFIX_SPAN_NAMES
from r3store.spans import SPAN_NAMES as SPAN_NAMES
from r3store.spans import ByteRange as ByteRange
from r3store.spans import RouteSpans as RouteSpans
from r3store.spans import Span as Span
