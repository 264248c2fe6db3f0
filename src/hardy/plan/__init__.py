"""A pipeline compiled for one call: the steps needed for the names given and asked for, generated as
Python source and compiled once (`compiled`, `source`), kept in one memo (`memo`); a map's items
(`map_items`, `columns`) and a batch's rows (`rows`). Below shipping, which sends plans to workers."""
