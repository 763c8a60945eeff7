"""``python -m es_ray.memory_plan``: the table (es_ray/memory_plan/table.py)."""

import sys

from es_ray.memory_plan.table import main

sys.exit(main())
