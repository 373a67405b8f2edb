"""keyinit.nn: keyed dropout and keyed forwards (keyed()), by feature in the folders below."""
