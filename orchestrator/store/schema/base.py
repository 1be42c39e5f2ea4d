"""The one ``MetaData`` every table of the schema belongs to, and the timestamp type they share."""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

TS = sa.DateTime(timezone=True)
