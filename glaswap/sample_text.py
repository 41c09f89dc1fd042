"""A few paragraphs of plain English (written for glaswap) for the step-0 report of `convert`.

They are short on purpose: the report shows where distillation starts, not a benchmark.
Use `glaswap eval` on real held-out text for figures worth quoting.
"""

SAMPLE_TEXT = """\
The harbour town woke slowly in winter. Before the sun cleared the hills, the baker on the corner
had already pulled two trays of bread from the oven, and the smell drifted down to the water where
the fishing boats knocked gently against the quay. Most mornings the fishermen argued about the
weather, though none of them could change it, and by the time they had finished their coffee the
question had usually been settled by the sky itself.

Anna kept the small library at the top of the hill. It had been a school once, and the old
classroom still had its long windows facing the sea. She opened at nine, but the first visitor
rarely came before ten, so she spent the quiet hour repairing books. A cracked spine needed glue
and patience; a torn page needed thin paper and a steady hand. She liked the work because it was
slow and because, when it was done well, nobody could tell that anything had ever been wrong.

In the spring the council decided to build a new road along the coast. Some people welcomed it,
since the old road flooded every autumn and the bus to the city often could not get through.
Others worried that the road would bring traffic and noise, and that the beach below the cliffs
would be crowded with visitors who did not care about the place. The meetings went on for weeks.
In the end the engineers proposed a route that kept well back from the cliffs, and most people
agreed that it was a reasonable compromise, even if nobody was entirely happy with it.

A computer program is a set of instructions that a machine follows exactly. This is both its
strength and its weakness. The machine never gets tired and never skips a step, but it also never
guesses what you meant. If the instructions say to divide by the number of items, and there are
no items, the program fails, even though any person would have known what to do. Good programmers
learn to think about these cases before they happen: the empty list, the missing file, the input
that is a little larger than anyone expected.

Testing is how programmers find out whether their instructions say what they think they say. A
test runs a small part of the program with known inputs and checks that the outputs are right.
When a test fails, it is not a disaster; it is information. The most useful tests are the ones
that fail for exactly one reason and say clearly what that reason is. A test that can never fail
is worse than no test at all, because it gives confidence that has not been earned.

The river that runs through the valley is fed by snow from the mountains. In early summer it is
fast and cold, and the water is the colour of milk because of the fine stone it carries down from
the glaciers. By late summer it slows and clears, and children swim in the pools below the old
mill. Farmers along the banks have used the water for centuries, and the rules about who may take
how much are older than anyone can remember. Disputes still happen, but they are settled at the
village meeting, usually over a long dinner, and the decisions are written in a book that is kept
in the church.

Learning a language as an adult is different from learning it as a child. Adults can study
grammar and memorise lists of words, which children cannot do, but they often find it harder to
hear the small differences in sound that mark one word from another. The best method seems to be
a mixture: some careful study, and a great deal of listening and speaking, especially with people
who are patient enough to let you make mistakes. Progress feels slow at first, then suddenly one
day a conversation happens without effort, and it is hard to remember why it was ever difficult.

When the storm finally came, it arrived in the night. The wind rose steadily for an hour, then
all at once it was roaring, and rain struck the windows as if someone were throwing gravel. In
the morning the harbour was full of broken branches, and one of the smaller boats had sunk at its
mooring. Nobody had been hurt. By noon the fishermen had pulled the boat up onto the slipway, and
by evening they were arguing again about whether it could be repaired or should be burned.
"""
