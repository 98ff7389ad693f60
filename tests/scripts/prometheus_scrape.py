#!/usr/bin/python3
"""Helper of tests/scripts/prometheus_exporter.sh (not a suite of its own).

  prometheus_scrape.py scrape URL RAWFILE
      Fetches URL (retrying for up to 20 s while the exporter starts), keeps the text in
      RAWFILE and parses it with prometheus_client.parser.text_string_to_metric_families.
      Prints, one per line:
        TYPE <name> <type>       each metric family; <name> as exposed (a counter's
                                 name keeps the _total the exporter gave it)
        SAMPLE <key>\t<value>    each sample, key = name{label="value",...} with the
                                 labels sorted and the exporter's "server" label left out
        LABEL <value>            every label value of every sample (server included)
  prometheus_scrape.py defs QUERIES_YAML
      Prints "<metric name> <counter|gauge|histogram>" for every metric column of an
      --extend.query-path file, named as postgres_exporter 0.11 names them:
      <namespace>_<column>.
  prometheus_scrape.py norm
      Reads "<key>\t<value>" lines and prints them with the value formatted as SAMPLE
      lines have it, so that SQL results compare as text.
"""
import sys
import time
import urllib.request


def fmt(v):
    v = float(v)
    if v != v:
        return "NaN"
    if v.is_integer() and abs(v) < 2**53:
        return "%d" % v
    return repr(v)


def scrape(url, rawfile):
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.time() + 20
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                text = r.read().decode("utf-8")
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)
    with open(rawfile, "w") as f:
        f.write(text)
    declared = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0] == "#" and parts[1] == "TYPE":
            declared.add(parts[2])
    out = []
    for fam in text_string_to_metric_families(text):
        name = fam.name
        if fam.type == "counter" and name + "_total" in declared:
            name += "_total"
        out.append("TYPE %s %s" % (name, fam.type))
        for s in fam.samples:
            labels = ",".join(
                '%s="%s"' % (k, v) for k, v in sorted(s.labels.items()) if k != "server"
            )
            out.append("SAMPLE %s{%s}\t%s" % (s.name, labels, fmt(s.value)))
            for v in s.labels.values():
                out.append("LABEL %s" % v)
    print("\n".join(out))


def defs(path):
    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f)
    for ns, spec in doc.items():
        for m in spec["metrics"]:
            for col, opt in m.items():
                usage = opt["usage"].upper()
                if usage in ("COUNTER", "GAUGE", "HISTOGRAM"):
                    print("%s_%s %s" % (ns, col, usage.lower()))


def norm():
    for line in sys.stdin:
        line = line.rstrip("\n")
        if not line:
            continue
        key, value = line.rsplit("\t", 1)
        print("%s\t%s" % (key, fmt(value)))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "scrape":
        scrape(sys.argv[2], sys.argv[3])
    elif cmd == "defs":
        defs(sys.argv[2])
    elif cmd == "norm":
        norm()
    else:
        sys.exit("unknown command " + cmd)
