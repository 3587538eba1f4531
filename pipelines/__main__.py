"""``python -m kiproxy.pipelines replay|report ...``, and the script to hand to ``spark-submit``::

    spark-submit --master yarn \
        "$(python -c 'import kiproxy.pipelines.__main__ as m; print(m.__file__)')" \
        replay --bootstrap kafka-1:9092 --topic orders --interceptor my_policy:MyPolicy ...
"""

import sys

from kiproxy.pipelines.cli import main

if __name__ == "__main__":
    sys.exit(main())
