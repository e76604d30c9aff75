"""deploy/k8s/, checked offline: each overlay is rendered (a small Kustomize renderer of the fields
the manifests use, cross-checked against `kubectl kustomize` when a kubectl with Kustomize v4 or
later is on PATH), every object is validated against the Kubernetes API models of Debian's
python3-kubernetes (unknown fields, wrong types and missing required fields are errors; the
models are API 1.22, so the one newer field used, a probe's `grpc` (1.24), is described here),
the group's invariants hold (replicas and EMBPS_REPLICAS agree; probes are gRPC on the client
port; the grace period outlasts the drain; Services and the PodDisruptionBudget select the pods;
the checkpoint volume is one ReadWriteMany claim mounted at EMBPS_CHECKPOINT_DIR; ...), every
EMBPS_* variable set is one `embps-server --help` lists (or one deploy/entrypoint.sh consumes),
and the entrypoint, run as each pod would run it, gives each rank its rank and the same peer
list, which the server's own settings parser accepts.

Exits 77 (skipped) when python3-yaml or python3-kubernetes is missing."""
import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S = os.path.join(ROOT, "deploy", "k8s")
ENTRYPOINT = os.path.join(ROOT, "deploy", "entrypoint.sh")

try:
    import yaml
except ImportError:
    print("SKIP: python3-yaml is not installed (deploy/packages.sh installs it)")
    sys.exit(77)
try:
    from kubernetes.client import models as k8s_models
    from kubernetes.client.configuration import Configuration
except ImportError:
    print("SKIP: python3-kubernetes is not installed (deploy/packages.sh installs it)")
    sys.exit(77)

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
    return cond


# ---------------------------------------------------------------------------------------------
# A minimal Kustomize: resources (files and directories), configMapGenerator (literals;
# behavior create or merge) with a content hash suffix and the references to it renamed,
# images, replicas, and patches (strategic merge, inline or by path, targeted by kind and name).
# Any other field is an error, so the renderer cannot silently diverge from Kustomize.
KNOWN_FIELDS = {"apiVersion", "kind", "resources", "configMapGenerator", "images", "replicas",
                "patches"}
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "ports": "containerPort", "envFrom": None}


def smp(base, patch):
    """Strategic merge patch of the shapes the overlays use (lists of containers, env, volumes,
    volume mounts, ports merge by their key; other lists are replaced)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if isinstance(v, dict) and "$patch" in v or k.startswith("$"):
                raise SystemExit(f"renderer: '$patch' directives are not supported ({k})")
            if v is None:
                out.pop(k, None)
            elif k in out and isinstance(v, list) and MERGE_KEYS.get(k):
                key, merged = MERGE_KEYS[k], list(out[k])
                for item in v:
                    idx = [i for i, b in enumerate(merged) if b.get(key) == item.get(key)]
                    if idx:
                        merged[idx[0]] = smp(merged[idx[0]], item)
                    else:
                        merged.append(item)
                out[k] = merged
            elif k in out:
                out[k] = smp(out[k], v)
            else:
                out[k] = v
        return out
    return copy.deepcopy(patch)


def parse_literals(lits):
    data = {}
    for lit in lits:
        k, sep, v = lit.partition("=")
        if not sep:
            raise SystemExit(f"renderer: literal '{lit}' has no '='")
        data[k.strip()] = v
    return data


def render_dir(d):
    with open(os.path.join(d, "kustomization.yaml")) as f:
        kz = yaml.safe_load(f)
    unknown = set(kz) - KNOWN_FIELDS
    if unknown:
        raise SystemExit(f"renderer: {d}/kustomization.yaml uses {sorted(unknown)}, which this "
                         "test's renderer does not implement")
    objs, gens = [], {}
    for r in kz.get("resources", []):
        p = os.path.normpath(os.path.join(d, r))
        if os.path.isdir(p):
            sub_objs, sub_gens = render_dir(p)
            objs += sub_objs
            gens.update(sub_gens)
        else:
            with open(p) as f:
                objs += [o for o in yaml.safe_load_all(f) if o]
    for g in kz.get("configMapGenerator", []):
        behavior = g.get("behavior", "create")
        if set(g) - {"name", "literals", "behavior"}:
            raise SystemExit(f"renderer: configMapGenerator fields {sorted(set(g))}")
        data = parse_literals(g.get("literals", []))
        if behavior == "merge":
            gens[g["name"]] = {**gens[g["name"]], **data}
        elif behavior == "create":
            if g["name"] in gens:
                raise SystemExit(f"renderer: configMap {g['name']} created twice")
            gens[g["name"]] = data
        else:
            raise SystemExit(f"renderer: behavior {behavior}")
    for p in kz.get("patches", []):
        if "patch" in p:
            patch = yaml.safe_load(p["patch"])
        else:
            with open(os.path.join(d, p["path"])) as f:
                patch = yaml.safe_load(f)
        if set(p) - {"patch", "path"}:
            raise SystemExit(f"renderer: patch fields {sorted(set(p))}")
        hits = [i for i, o in enumerate(objs) if o["kind"] == patch["kind"]
                and o["metadata"]["name"] == patch["metadata"]["name"]]
        if len(hits) != 1:
            raise SystemExit(f"renderer: patch for {patch['kind']}/{patch['metadata']['name']} "
                             f"matches {len(hits)} objects")
        objs[hits[0]] = smp(objs[hits[0]], patch)
    for r in kz.get("replicas", []):
        for o in objs:
            if o["metadata"]["name"] == r["name"] and o["kind"] in ("StatefulSet", "Deployment"):
                o["spec"]["replicas"] = r["count"]
    for im in kz.get("images", []):
        for o in objs:
            pod = o.get("spec", {}).get("template", {}).get("spec", {})
            for c in pod.get("containers", []) + pod.get("initContainers", []):
                name = re.split(r"[:@]", c["image"])[0]
                if name == im["name"]:
                    c["image"] = im.get("newName", name) + (":" + im["newTag"] if "newTag" in im
                                                            else c["image"][len(name):])
    return objs, gens


def render(d):
    objs, gens = render_dir(d)
    names = {}
    for name, data in gens.items():
        j = json.dumps({"data": data, "kind": "ConfigMap", "name": name}, sort_keys=True)
        h = hashlib.sha256(j.encode()).hexdigest()[:10].translate(str.maketrans("013ae", "ghkmt"))
        names[name] = f"{name}-{h}"
        objs.insert(0, {"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": names[name]}, "data": data})
    for o in objs:
        pod = o.get("spec", {}).get("template", {}).get("spec", {})
        for c in pod.get("containers", []):
            for ef in c.get("envFrom", []):
                if "configMapRef" in ef and ef["configMapRef"]["name"] in names:
                    ef["configMapRef"]["name"] = names[ef["configMapRef"]["name"]]
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("configMapKeyRef")
                if ref and ref["name"] in names:
                    ref["name"] = names[ref["name"]]
        for v in pod.get("volumes", []):
            if "configMap" in v and v["configMap"]["name"] in names:
                v["configMap"]["name"] = names[v["configMap"]["name"]]
    return objs


def kubectl_kustomize(d):
    """`kubectl kustomize DIR` when a kubectl with Kustomize v4+ is here, else None."""
    kubectl = shutil.which("kubectl")
    if not kubectl:
        return None
    try:
        v = subprocess.run([kubectl, "version", "--client"], capture_output=True, text=True,
                           timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Kustomize Version: v(\d+)", v)
    if not m or int(m.group(1)) < 4:
        return None
    out = subprocess.run([kubectl, "kustomize", d], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        failures.append(f"kubectl kustomize {d} failed: {out.stderr.strip()}")
        return None
    return [o for o in yaml.safe_load_all(out.stdout) if o]


def without_hash(objs):
    """The objects keyed by kind/name, with the ConfigMap hash suffixes cut off (this renderer's
    hash is its own)."""
    s = json.dumps(objs, sort_keys=True)
    s = re.sub(r'"(embps-config)-[a-z0-9]{10}"', r'"\1-HASH"', s)
    return {(o["kind"], o["metadata"]["name"]): o for o in json.loads(s)}


# ---------------------------------------------------------------------------------------------
# Schema validation against python3-kubernetes' models (API 1.22).
KINDS = {("v1", "ConfigMap"): "V1ConfigMap", ("v1", "Service"): "V1Service",
         ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
         ("apps/v1", "StatefulSet"): "V1StatefulSet",
         ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget"}
# Fields newer than the models (Kubernetes API reference): model -> {json field: type}.
NEWER_FIELDS = {"V1Probe": {"grpc": "GRPCAction"}}  # 1.24 GA
PSEUDO_MODELS = {"GRPCAction": ({"port": "int", "service": "str"}, {"port"})}
CFG = Configuration()
CFG.client_side_validation = True


def validate(v, typ, path):
    """Raises ValueError naming the path of the first field that does not fit typ; returns the
    model object (so the models' own required-field and enum checks run)."""
    if typ == "object":
        return v
    if typ in ("str", "datetime", "date"):
        if not isinstance(v, str):
            raise ValueError(f"{path}: {v!r} is not a string")
        return v
    if typ == "int":
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{path}: {v!r} is not an integer")
        return v
    if typ == "bool":
        if not isinstance(v, bool):
            raise ValueError(f"{path}: {v!r} is not a boolean")
        return v
    if typ == "float":
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ValueError(f"{path}: {v!r} is not a number")
        return v
    m = re.fullmatch(r"list\[(.+)\]", typ)
    if m:
        if not isinstance(v, list):
            raise ValueError(f"{path}: not a list")
        return [validate(x, m.group(1), f"{path}[{i}]") for i, x in enumerate(v)]
    m = re.fullmatch(r"dict\(str, (.+)\)", typ)
    if m:
        if not isinstance(v, dict):
            raise ValueError(f"{path}: not a map")
        return {k: validate(x, m.group(1), f"{path}.{k}") for k, x in v.items()}
    if not isinstance(v, dict):
        raise ValueError(f"{path}: not an object ({typ})")
    if typ in PSEUDO_MODELS:
        fields, required = PSEUDO_MODELS[typ]
        for k, x in v.items():
            if k not in fields:
                raise ValueError(f"{path}.{k}: unknown field (in {typ})")
            validate(x, fields[k], f"{path}.{k}")
        for k in required - set(v):
            raise ValueError(f"{path}: {typ} needs {k}")
        return v
    cls = getattr(k8s_models, typ)
    json_to_attr = {j: a for a, j in cls.attribute_map.items()}
    kwargs = {}
    for k, x in v.items():
        if k in NEWER_FIELDS.get(typ, {}):
            validate(x, NEWER_FIELDS[typ][k], f"{path}.{k}")
        elif k not in json_to_attr:
            raise ValueError(f"{path}.{k}: unknown field (in {typ})")
        else:
            kwargs[json_to_attr[k]] = validate(x, cls.openapi_types[json_to_attr[k]],
                                               f"{path}.{k}")
    try:
        return cls(local_vars_configuration=CFG, **kwargs)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def validate_object(o, where):
    key = (o.get("apiVersion"), o.get("kind"))
    if not check(key in KINDS, f"{where}: unexpected kind {key}"):
        return
    try:
        validate(o, KINDS[key], f"{where} {o['kind']}/{o.get('metadata', {}).get('name')}")
    except ValueError as e:
        failures.append(f"schema: {e}")


# ---------------------------------------------------------------------------------------------
def help_env_names(server_bin):
    out = subprocess.run([server_bin, "--help"], capture_output=True, text=True, timeout=60,
                         env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    if out.returncode != 0:
        raise SystemExit(f"{server_bin} --help failed: {out.stderr}")
    return set(re.findall(r"env (EMBPS_[A-Z0-9_]+)", out.stdout))


def entrypoint_env_names():
    """The variables the entrypoint consumes itself: named in an `unset` (so never passed on to
    the server) and read with ${NAME...}."""
    with open(ENTRYPOINT) as f:
        text = f.read()
    names = set()
    for line in re.findall(r"^\s*unset (.+)$", text, re.M):
        names |= {n for n in line.split() if n.startswith("EMBPS_")}
    return {n for n in names if re.search(r"\$\{" + n + r"[:}]", text)}


def quantity(q):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGTE]i?|m)?", str(q))
    if not m:
        raise ValueError(f"quantity {q!r}")
    mult = {None: 1, "m": 1e-3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10,
            "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[m.group(2)]
    return float(m.group(1)) * mult


def size_setting(text):
    m = re.fullmatch(r"(\d+)([KMGTkmgt])?(i|B|iB)?", text)
    if not m:
        return -1  # not a size: the server's parser (run below) names the problem
    return int(m.group(1)) << {None: 0, "k": 10, "m": 20, "g": 30, "t": 40}[
        m.group(2).lower() if m.group(2) else None]


def k8s_expand(value, env):
    """Kubernetes' $(VAR) expansion in env values ($$ escapes a $)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


def check_overlay(name, objs, help_names, ep_names, server_bin):
    where = f"overlay {name}"
    for o in objs:
        validate_object(o, where)
    by_kind = {}
    for o in objs:
        by_kind.setdefault(o["kind"], []).append(o)
    stss = by_kind.get("StatefulSet", [])
    if not check(len(stss) == 1, f"{where}: {len(stss)} StatefulSets, expected 1"):
        return
    sts = stss[0]
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    pod_labels = sts["spec"]["template"]["metadata"].get("labels", {})
    replicas = spec.get("replicas", 1)
    selects = lambda sel: bool(sel) and all(pod_labels.get(k) == v for k, v in sel.items())
    check(selects(spec["selector"].get("matchLabels")), f"{where}: the StatefulSet's selector "
          "does not match its pod labels")
    check(spec.get("podManagementPolicy") == "Parallel",
          f"{where}: podManagementPolicy must be Parallel (the ranks form the group together)")
    check(spec.get("updateStrategy", {}).get("type") == "OnDelete",
          f"{where}: updateStrategy must be OnDelete (a rolling update is one blip per rank)")
    check(pod.get("enableServiceLinks") is False,
          f"{where}: enableServiceLinks must be false (Service variables named EMBPS_*)")
    containers = pod["containers"]
    check(len(containers) == 1, f"{where}: one container expected")
    c = containers[0]

    # The environment the server sees: the ConfigMaps of envFrom, then env.
    configmaps = {o["metadata"]["name"]: o for o in by_kind.get("ConfigMap", [])}
    env, set_names = {}, []
    for ef in c.get("envFrom", []):
        ref = ef.get("configMapRef", {}).get("name")
        if check(ref in configmaps, f"{where}: envFrom names ConfigMap {ref}, not rendered"):
            env.update(configmaps[ref].get("data", {}))
            set_names += [(f"ConfigMap {ref}", k) for k in configmaps[ref].get("data", {})]
    for o in configmaps.values():  # a ConfigMap not used through envFrom still holds settings
        set_names += [(f"ConfigMap {o['metadata']['name']}", k) for k in o.get("data", {})]
    for cc in containers + pod.get("initContainers", []):
        set_names += [(f"container {cc['name']} env", e["name"]) for e in cc.get("env", [])]
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = k8s_expand(e["value"], env)
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[e["name"]] = "NAMESPACE"
        else:
            env[e["name"]] = "(from " + json.dumps(e.get("valueFrom")) + ")"
    known = help_names | ep_names
    for src, n in sorted(set(set_names)):
        if n.startswith("EMBPS_"):
            check(n in known, f"{where}: {src} sets {n}, which `embps-server --help` does not "
                  "list (nor does deploy/entrypoint.sh consume it): a renamed or missing setting")

    def setting(n, default):
        return env.get(n, default)

    # The group size: one number, in two places that must agree.
    if "EMBPS_PEERS" in env:
        check(len(env["EMBPS_PEERS"].split(",")) == replicas,
              f"{where}: EMBPS_PEERS lists {len(env['EMBPS_PEERS'].split(','))} ranks, "
              f"replicas is {replicas}")
    else:
        check(env.get("EMBPS_REPLICAS") == str(replicas),
              f"{where}: EMBPS_REPLICAS={env.get('EMBPS_REPLICAS')} but replicas is {replicas}")

    # Ports and probes: every probe is gRPC health on the client port.
    ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    listen_port = int(setting("EMBPS_LISTEN", "0.0.0.0:7070").rsplit(":", 1)[1])
    check(ports.get("grpc") == listen_port,
          f"{where}: port 'grpc' is {ports.get('grpc')}, EMBPS_LISTEN's port is {listen_port}")
    check(ports.get("peer") == listen_port + int(setting("EMBPS_PEER_PORT_OFFSET", "1000")),
          f"{where}: port 'peer' is not the client port plus EMBPS_PEER_PORT_OFFSET")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c.get(probe)
        if check(p is not None, f"{where}: no {probe}"):
            check(set(p) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"},
                  f"{where}: {probe} must be a gRPC probe")
            g = p.get("grpc", {})
            check(g.get("port") == listen_port,
                  f"{where}: {probe} asks port {g.get('port')}, the client port is {listen_port}")
            check(g.get("service", "") in ("", "embps.v1.EmbeddingService"),
                  f"{where}: {probe} asks service {g.get('service')!r}, unknown to the server")
    sp = c.get("startupProbe", {})
    window = sp.get("initialDelaySeconds", 0) + sp.get("periodSeconds", 10) * sp.get(
        "failureThreshold", 3)
    boot = int(setting("EMBPS_BOOTSTRAP_TIMEOUT_MS", "120000")) / 1000
    check(window > boot, f"{where}: the startup probe gives up after {window} s, before the "
          f"bootstrap timeout ({boot} s)")
    drain = int(setting("EMBPS_DRAIN_TIMEOUT_MS", "20000")) / 1000
    grace = pod.get("terminationGracePeriodSeconds", 30)
    check(grace > drain + 5, f"{where}: terminationGracePeriodSeconds {grace} is not above the "
          f"drain timeout ({drain} s) with a margin")

    # Services and the budget select the pods; the headless one publishes unready pods.
    services = {o["metadata"]["name"]: o for o in by_kind.get("Service", [])}
    hs = services.get(spec.get("serviceName"))
    if check(hs is not None, f"{where}: serviceName {spec.get('serviceName')} is not rendered"):
        check(hs["spec"].get("clusterIP") == "None", f"{where}: {hs['metadata']['name']} is not "
              "headless (clusterIP: None)")
        check(hs["spec"].get("publishNotReadyAddresses") is True,
              f"{where}: the headless Service must publish not-ready addresses (a rank is Ready "
              "only once the group has formed, and the ranks find each other by these names)")
        check(selects(hs["spec"].get("selector")), f"{where}: the headless Service does not "
              "select the StatefulSet's pods")
    clients = [s for s in services.values() if s["spec"].get("clusterIP") != "None"]
    check(len(clients) == 1, f"{where}: expected one client Service")
    for s in clients:
        check(selects(s["spec"].get("selector")), f"{where}: Service {s['metadata']['name']} "
              "does not select the pods")
        for p in s["spec"]["ports"]:
            tp = p.get("targetPort", p["port"])
            check(tp in ports and ports[tp] == listen_port or tp == listen_port,
                  f"{where}: client Service port {p['port']} does not reach the client port")
    pdbs = by_kind.get("PodDisruptionBudget", [])
    if check(len(pdbs) == 1, f"{where}: expected one PodDisruptionBudget"):
        pdb = pdbs[0]["spec"]
        check(selects(pdb.get("selector", {}).get("matchLabels")),
              f"{where}: the PodDisruptionBudget does not select the pods")
        check(pdb.get("maxUnavailable") in (0, 1) or pdb.get("minAvailable") in
              (replicas, replicas - 1), f"{where}: the PodDisruptionBudget allows more than one "
              "rank down at a time")

    # Checkpoints: one ReadWriteMany claim, mounted at EMBPS_CHECKPOINT_DIR.
    check(not spec.get("volumeClaimTemplates"), f"{where}: a volume per rank cannot hold a "
          "checkpoint (every rank must see the same directory)")
    ckpt_dir = env.get("EMBPS_CHECKPOINT_DIR")
    pvcs = {o["metadata"]["name"]: o for o in by_kind.get("PersistentVolumeClaim", [])}
    if check(ckpt_dir, f"{where}: no EMBPS_CHECKPOINT_DIR"):
        mounts = [m for m in c.get("volumeMounts", []) if m["mountPath"] == ckpt_dir]
        if check(len(mounts) == 1, f"{where}: nothing mounted at {ckpt_dir}"):
            vol = [v for v in pod.get("volumes", []) if v["name"] == mounts[0]["name"]]
            claim = vol[0].get("persistentVolumeClaim", {}).get("claimName") if vol else None
            if check(claim in pvcs, f"{where}: {ckpt_dir} is not a rendered PersistentVolumeClaim"):
                check(pvcs[claim]["spec"].get("accessModes") == ["ReadWriteMany"],
                      f"{where}: the checkpoint claim must be ReadWriteMany")
            check(not mounts[0].get("readOnly"), f"{where}: the checkpoint mount is read-only")

    # The group secret: EMBPS_GROUP_SECRET_FILE lies in a read-only Secret volume that only its
    # owner and group may read (without it any process reaching the peer port joins the group).
    secret_file = env.get("EMBPS_GROUP_SECRET_FILE")
    if check(secret_file, f"{where}: no EMBPS_GROUP_SECRET_FILE"):
        mounts = [m for m in c.get("volumeMounts", [])
                  if secret_file.startswith(m["mountPath"].rstrip("/") + "/")]
        if check(len(mounts) == 1, f"{where}: nothing mounted above {secret_file}"):
            check(mounts[0].get("readOnly") is True, f"{where}: the group secret mount is writable")
            vol = [v for v in pod.get("volumes", []) if v["name"] == mounts[0]["name"]]
            sec = vol[0].get("secret") if vol else None
            if check(sec and sec.get("secretName"), f"{where}: {secret_file} is not from a Secret"):
                check(sec.get("defaultMode", 0o644) & 0o007 == 0,
                      f"{where}: the group secret is readable by every user (defaultMode)")

    # Metrics: the scrape annotations name EMBPS_METRICS_LISTEN's port.
    ann = sts["spec"]["template"]["metadata"].get("annotations", {})
    metrics = env.get("EMBPS_METRICS_LISTEN", "")
    if check(metrics, f"{where}: no EMBPS_METRICS_LISTEN"):
        mport = metrics.rsplit(":", 1)[1]
        check(ann.get("prometheus.io/scrape") == "true" and ann.get("prometheus.io/port") ==
              mport and ann.get("prometheus.io/path") == "/metrics",
              f"{where}: the Prometheus annotations do not point at {metrics}/metrics")
        check(ports.get("metrics") == int(mport), f"{where}: port 'metrics' is not {mport}")

    # Security and resources.
    psc, csc = pod.get("securityContext", {}), c.get("securityContext", {})
    uid = csc.get("runAsUser", psc.get("runAsUser"))
    check(csc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True and isinstance(uid, int)
          and uid > 0, f"{where}: must run as a numeric non-root user")
    check(csc.get("readOnlyRootFilesystem") is True, f"{where}: root filesystem not read-only")
    check(csc.get("allowPrivilegeEscalation") is False, f"{where}: privilege escalation allowed")
    res = c.get("resources", {})
    mem = res.get("limits", {}).get("memory")
    device = env.get("EMBPS_DEVICE", "auto")
    check(re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", device),
          f"{where}: EMBPS_DEVICE={device} is not auto, cpu, cuda or cuda:N")
    if check(mem and res.get("requests", {}).get("memory") and res["requests"].get("cpu"),
             f"{where}: memory limit and cpu/memory requests must be set"):
        if device == "cpu":
            mmb = env.get("EMBPS_MAX_MEMORY_BYTES")
            check(mmb and 0 < size_setting(mmb) < quantity(mem), f"{where}: "
                  f"EMBPS_MAX_MEMORY_BYTES ({mmb}) must be set below the memory limit ({mem}); "
                  "its default follows the node's memory, not the pod's")
    gpus = res.get("limits", {}).get("nvidia.com/gpu")
    if device.startswith("cuda"):
        check(gpus == "1", f"{where}: the cuda backend needs limits nvidia.com/gpu: 1 (one per rank)")
    else:
        check(gpus is None, f"{where}: --device {device} but the pods ask for GPUs")
    check(":" in c["image"].rsplit("/", 1)[-1], f"{where}: the image has no tag")

    # The entrypoint, as each pod runs it: rank and peer list, then the server's parser.
    server_env = {k: v for k, v in env.items()}
    server_env["NAMESPACE"] = "ns"
    for k, v in list(server_env.items()):
        server_env[k] = v.replace("NAMESPACE", "ns")
    peer_lists = set()
    for ordinal in range(replicas):
        host = f"{sts['metadata']['name']}-{ordinal}"
        run_env = dict(server_env, HOSTNAME=host, PATH=os.environ.get("PATH", "/usr/bin:/bin"),
                       EMBPS_SERVER_BIN=shutil.which("env") or "/usr/bin/env")
        out = subprocess.run(["/bin/sh", ENTRYPOINT], env=run_env, capture_output=True,
                             text=True, timeout=60)
        if not check(out.returncode == 0, f"{where}: the entrypoint fails on pod {host}: "
                     f"{out.stderr.strip()}"):
            continue
        seen = dict(l.split("=", 1) for l in out.stdout.splitlines() if "=" in l)
        check(seen.get("EMBPS_RANK") == str(ordinal), f"{where}: pod {host} gets rank "
              f"{seen.get('EMBPS_RANK')}")
        for n in ep_names:
            check(n not in seen, f"{where}: the entrypoint passes {n} on to the server")
        peers = seen.get("EMBPS_PEERS", "").split(",")
        want = [f"{sts['metadata']['name']}-{i}.{spec['serviceName']}.ns.svc.cluster.local:"
                f"{listen_port}" for i in range(replicas)]
        check(peers == want, f"{where}: pod {host} gets peers {peers}, expected {want}")
        peer_lists.add(tuple(peers))
        run_env["EMBPS_SERVER_BIN"] = server_bin
        out = subprocess.run(["/bin/sh", ENTRYPOINT, "--help"], env=run_env, capture_output=True,
                             text=True, timeout=60)
        check(out.returncode == 0, f"{where}: embps-server refuses pod {host}'s settings: "
              f"{out.stderr.strip()}")
    check(len(peer_lists) <= 1, f"{where}: the ranks disagree on the peer list")


def main():
    server_bin = os.environ.get("EMBPS_SERVER_BIN")
    if not server_bin or not os.access(server_bin, os.X_OK):
        print("FAIL: EMBPS_SERVER_BIN must name the built embps-server")
        return 1
    help_names = help_env_names(server_bin)
    ep_names = entrypoint_env_names()
    check(help_names, "no EMBPS_* variable in `embps-server --help`")
    overlays = sorted(os.listdir(os.path.join(K8S, "overlays")))
    check({"cpu", "gpu"} <= set(overlays), f"overlays {overlays}: cpu and gpu expected")
    cross = 0
    for name in overlays:
        d = os.path.join(K8S, "overlays", name)
        try:
            objs = render(d)
        except Exception as e:  # noqa: BLE001 - a malformed manifest is a failure, not a crash
            failures.append(f"overlay {name}: cannot render: {type(e).__name__}: {e}")
            continue
        ref = kubectl_kustomize(d)
        if ref is not None:
            cross += 1
            mine, theirs = without_hash(objs), without_hash(ref)
            check(mine == theirs, f"overlay {name}: this test's rendering differs from kubectl "
                  f"kustomize's:\n  test: {json.dumps(mine and sorted(map(str, mine)))}\n"
                  + "\n".join(f"  {k}: test {json.dumps(mine.get(k), sort_keys=True)}\n"
                              f"  {k}: kubectl {json.dumps(theirs.get(k), sort_keys=True)}"
                              for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)))
        try:
            check_overlay(name, objs, help_names, ep_names, server_bin)
        except Exception as e:  # noqa: BLE001
            failures.append(f"overlay {name}: {type(e).__name__}: {e} (a malformed manifest?)")
        print(f"overlay {name}: {len(objs)} objects checked")
    print(f"rendered by kubectl kustomize too: {cross} of {len(overlays)} overlays"
          + ("" if cross else " (no kubectl with Kustomize v4+ here)"))
    for f in failures:
        print("FAIL:", f)
    print(f"{0 if failures else 1} passed, {1 if failures else 0} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
