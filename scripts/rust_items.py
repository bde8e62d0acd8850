"""Rust source helpers shared by the project's scripts (check-layers.py, count-src-lines.py)."""


def strip_tests(text: str) -> str:
    """The file without its `#[cfg(test)]` items (a module, a use, an impl, a function)."""
    out, i = [], 0
    while True:
        j = text.find("#[cfg(test)]", i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j])
        # Skip the attribute's item: up to the end of its first `;` or its balanced `{...}`.
        k = j + len("#[cfg(test)]")
        depth = 0
        while k < len(text):
            c = text[k]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    k += 1
                    break
            elif c == ";" and depth == 0:
                k += 1
                break
            k += 1
        i = k
