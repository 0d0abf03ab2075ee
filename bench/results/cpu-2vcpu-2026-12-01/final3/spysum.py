import collections
import sys

leaf = collections.Counter()
incl = collections.Counter()
total = 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n)
    total += n
    frames = stack.split(";")
    leaf[frames[-1]] += n
    for f in set(frames):
        incl[f] += n
print("total samples", total)
print("-- leaf")
[print(f"{v / total:6.1%} {k[:150]}") for k, v in leaf.most_common(18)]
print("-- inclusive")
[print(f"{v / total:6.1%} {k[:150]}") for k, v in incl.most_common(30)]
