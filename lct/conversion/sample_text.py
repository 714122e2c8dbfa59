"""The text ``lct verify --quality`` scores when none is given: English prose in the public domain
and Python source shipped in this package.

- Prose: the Preamble of the United States Constitution (1787), the opening of the Declaration
  of Independence (1776) and the Gettysburg Address (1863, Bliss copy). Works of the United
  States government of that era: public domain.
- Code: LCT's own modules ``lct/conversion/converter.py`` and ``lct/format/manifest.py`` as installed (Apache-2.0,
  this package's licence), read from the package at run time.
"""

from __future__ import annotations

from pathlib import Path

PROSE = """\
We the People of the United States, in Order to form a more perfect Union, establish Justice, \
insure domestic Tranquility, provide for the common defence, promote the general Welfare, and \
secure the Blessings of Liberty to ourselves and our Posterity, do ordain and establish this \
Constitution for the United States of America.

When in the Course of human events, it becomes necessary for one people to dissolve the \
political bands which have connected them with another, and to assume among the powers of the \
earth, the separate and equal station to which the Laws of Nature and of Nature's God entitle \
them, a decent respect to the opinions of mankind requires that they should declare the causes \
which impel them to the separation.

We hold these truths to be self-evident, that all men are created equal, that they are endowed \
by their Creator with certain unalienable Rights, that among these are Life, Liberty and the \
pursuit of Happiness. That to secure these rights, Governments are instituted among Men, \
deriving their just powers from the consent of the governed, That whenever any Form of \
Government becomes destructive of these ends, it is the Right of the People to alter or to \
abolish it, and to institute new Government, laying its foundation on such principles and \
organizing its powers in such form, as to them shall seem most likely to effect their Safety \
and Happiness. Prudence, indeed, will dictate that Governments long established should not be \
changed for light and transient causes; and accordingly all experience hath shewn, that mankind \
are more disposed to suffer, while evils are sufferable, than to right themselves by abolishing \
the forms to which they are accustomed.

Four score and seven years ago our fathers brought forth on this continent, a new nation, \
conceived in Liberty, and dedicated to the proposition that all men are created equal.

Now we are engaged in a great civil war, testing whether that nation, or any nation so \
conceived and so dedicated, can long endure. We are met on a great battle-field of that war. We \
have come to dedicate a portion of that field, as a final resting place for those who here gave \
their lives that that nation might live. It is altogether fitting and proper that we should do \
this.

But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- \
this ground. The brave men, living and dead, who struggled here, have consecrated it, far above \
our poor power to add or detract. The world will little note, nor long remember what we say \
here, but it can never forget what they did here. It is for us the living, rather, to be \
dedicated here to the unfinished work which they who fought here have thus far so nobly \
advanced. It is rather for us to be here dedicated to the great task remaining before us -- \
that from these honored dead we take increased devotion to that cause for which they gave the \
last full measure of devotion -- that we here highly resolve that these dead shall not have \
died in vain -- that this nation, under God, shall have a new birth of freedom -- and that \
government of the people, by the people, for the people, shall not perish from the earth.
"""

CODE_MODULES = ("conversion/converter.py", "format/manifest.py")   # under lct/

# The calibration text of the auto policy (``lct convert`` without ``--calibration``): other text
# than the sample above, so that ``lct verify --quality`` checks the estimate on text it was not
# made on. Prose: the opening and the close of Abraham Lincoln's Second Inaugural Address (1865),
# a work of the United States government of that era: public domain. Code: two other modules.
CALIBRATION_PROSE = """\
Fellow-Countrymen: At this second appearing to take the oath of the Presidential office there is \
less occasion for an extended address than there was at the first. Then a statement somewhat in \
detail of a course to be pursued seemed fitting and proper. Now, at the expiration of four years, \
during which public declarations have been constantly called forth on every point and phase of \
the great contest which still absorbs the attention and engrosses the energies of the nation, \
little that is new could be presented. The progress of our arms, upon which all else chiefly \
depends, is as well known to the public as to myself, and it is, I trust, reasonably \
satisfactory and encouraging to all. With high hope for the future, no prediction in regard to \
it is ventured.

On the occasion corresponding to this four years ago all thoughts were anxiously directed to an \
impending civil war. All dreaded it, all sought to avert it. While the inaugural address was \
being delivered from this place, devoted altogether to saving the Union without war, insurgent \
agents were in the city seeking to destroy it without war, seeking to dissolve the Union and \
divide effects by negotiation. Both parties deprecated war, but one of them would make war \
rather than let the nation survive, and the other would accept war rather than let it perish, \
and the war came.

With malice toward none, with charity for all, with firmness in the right as God gives us to see \
the right, let us strive on to finish the work we are in, to bind up the nation's wounds, to \
care for him who shall have borne the battle and for his widow and his orphan, to do all which \
may achieve and cherish a just and lasting peace among ourselves and with all nations.
"""

CALIBRATION_CODE_MODULES = ("io/reader.py", "format/codecs.py")   # under lct/


def samples() -> list:
    """``[(name, text)]``: the prose, then each code module."""
    here = Path(__file__).parent.parent
    return [("public-domain prose (Constitution, Declaration, Gettysburg Address)", PROSE)] + [
        (f"lct/{name} (Apache-2.0)", (here / name).read_text(encoding="utf-8"))
        for name in CODE_MODULES]


def calibration_samples() -> list:
    """``[(name, text)]`` the auto policy calibrates on: ``CALIBRATION_PROSE``, then each of
    ``CALIBRATION_CODE_MODULES`` (none of them in ``samples()``)."""
    here = Path(__file__).parent.parent
    return [("public-domain prose (Second Inaugural Address)", CALIBRATION_PROSE)] + [
        (f"lct/{name} (Apache-2.0)", (here / name).read_text(encoding="utf-8"))
        for name in CALIBRATION_CODE_MODULES]
